"""Speculative decoding (docs/speculative.md): draft proposers (n-gram prompt lookup, suffix
trees, a draft model), the adaptive policy that decides per step how many draft tokens each
request gets, and the acceptance counters. Verification is the runner's: a request's draft rows
are computed as ordinary decode rows and sampled exactly as a normal step would sample them."""
