"""INT4 weight-only linears (W4A16), one home for the layer side; the format is
``kvserve/quant/int4.py`` (the canonical ``Int4Weight``, pack / unpack of compressed-tensors,
GPTQ and GGUF Q4 tensors, the per-module ``Int4Scheme``, RTN / AWQ) and the offline quantizer
``kvserve/quant/quantizer.py``; the pure-torch twins of the kernels are
``kvserve/kernels/reference/int4.py``. Which modules a checkpoint quantizes is read from
``quantization_config`` by ``kvserve/model/quant_config.py`` (GGUF: ``kvserve/model/gguf.py``).

    linear.py    Int4Linear: y = x W^T + b with W in 4-bit groups (act-order permutation, bias,
                 one compute method); ``to_device_layout`` for CUDA
    methods.py   the compute method, chosen once (CPU at build time, GPU by
                 ``to_device_layout``), and its kernel calls (C GEMV / CPU op / dequant + GEMM /
                 integer-dot GGUF tiles; Triton / tinygemm / dense on CUDA)
    layouts.py   the layouts the methods read (CPU op pack, wq tiles, GPU packs)
    merged.py    Int4MergedLinear: the stand-in for a Linear / MergedLinear whose checkpoint
                 tensors are INT4 (weight loaders with shard ids, tensor-parallel slicing)
    moe.py       Int4FusedMoE: an INT4 checkpoint's MoE experts as per-expert ``Linear`` /
                 ``MergedLinear`` modules that ``loading.swap_int4_modules`` swaps like any
                 other (routing and dispatch: ``kvserve.layers.moe``)
    kq_linear.py KqLinear: a GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K linear kept packed for the
                 integer-dot kernel kvserve/csrc/kq_gemm.c (format: ``kvserve/quant/kq.py``)
    loading.py   the loader's passes: swap the quantized modules in on the meta model,
                 dequantize those read as a dense matrix, pack for the device
    gguf_types.py   GGML_TYPES: how each ggml type of a GGUF file loads (packed: which builder;
                 else dequantized), the one table the GGUF loader reads
    gguf_linear.py  GGUFLinear: a linear module whose GGUF blocks stay packed (one part per run
                 of shards of one type)
    q8_linear.py    Q8_0 linears kept 8-bit (integer-dot 8-bit tiles)
"""
