"""Write a placeholder SentencePiece model (``<unk> <s> </s> w0 w1 ...``, ``vocab`` pieces) for
llama.cpp's HF -> GGUF converter, run in the converter's interpreter (which has sentencepiece
and protobuf: the converter needs them). The converter reads a Llama vocab from it when it
cannot convert the checkpoint's own tokenizer (a random Llama's word-level one); the bench
feeds token ids, so the vocab's text never matters.

Payload: {"vocab": int, "out": path of the tokenizer.model to write}. Prints {"ok": true}.
"""

import json
import sys

from sentencepiece import sentencepiece_model_pb2 as spm


def placeholder_model(vocab: int) -> bytes:
    m = spm.ModelProto()
    P = spm.ModelProto.SentencePiece
    specials = [("<unk>", P.UNKNOWN), ("<s>", P.CONTROL), ("</s>", P.CONTROL)]
    pieces = specials + [(f"w{j}", P.NORMAL) for j in range(vocab - len(specials))]
    for i, (text, kind) in enumerate(pieces):
        m.pieces.add(piece=text, score=-float(i), type=kind)
    m.trainer_spec.model_type = spm.TrainerSpec.UNIGRAM
    m.trainer_spec.vocab_size = vocab
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    return m.SerializeToString()


if __name__ == "__main__":
    cfg = json.load(sys.stdin)
    with open(cfg["out"], "wb") as f:
        f.write(placeholder_model(int(cfg["vocab"])))
    print(json.dumps({"ok": True}))
