"""Build a Megatron indexed dataset (PREFIX.bin and PREFIX.idx) from plain text files.

    python -m tools.prepare_data --input data/tiny_corpus/*.txt \
        --output-prefix out/demo/corpus/tiny_corpus

The tokenizer is Megatron-core's byte-level one (needs no download): each token is one byte of
the UTF-8 text, and token 0 (the NUL byte, which plain text never holds) ends a document. Each
paragraph (text between blank lines) is one document, or each file with --document-per-file.
Train on the result with ``pretrain_gpt.py --data-path PREFIX --tokenizer-type
ByteLevelTokenizer``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np


def byte_level_tokenizer():
    """Megatron-core's byte-level tokenizer, as pretrain_gpt.py builds it."""
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "byte-level"}, vocab_size=256
    )


def documents(paths: list[Path], per_file: bool):
    """The text of each document, in order."""
    for path in paths:
        text = path.read_text(encoding="utf-8")
        if "\0" in text:
            raise ValueError(f"{path}: holds a NUL byte, which is the end-of-document token")
        parts = [text] if per_file else re.split(r"\n\s*\n", text)
        yield from (p.strip() for p in parts if p.strip())


def build(paths: list[Path], output_prefix: str, per_file: bool = False) -> dict[str, int]:
    """Tokenize ``paths`` into ``output_prefix``.bin/.idx; returns document and token counts."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tokenizer = byte_level_tokenizer()
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(f"{output_prefix}.bin", dtype=dtype)
    count = {"documents": 0, "tokens": 0}
    for text in documents(paths, per_file):
        tokens = list(tokenizer.tokenize(text)) + [tokenizer.eod]
        builder.add_document(np.array(tokens, dtype=dtype), [len(tokens)])
        count["documents"] += 1
        count["tokens"] += len(tokens)
    if not count["documents"]:
        raise ValueError(f"no text in {', '.join(map(str, paths))}")
    builder.finalize(f"{output_prefix}.idx")
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, type=Path, help="plain text files")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument(
        "--document-per-file",
        action="store_true",
        help="one document per file (default: one per paragraph)",
    )
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.input if not p.is_file()]
    if missing:
        parser.error(f"--input: not a file: {', '.join(missing)}")
    try:
        count = build(args.input, args.output_prefix, args.document_per_file)
    except (ValueError, UnicodeDecodeError) as error:
        parser.error(str(error))
    print(
        f"{args.output_prefix}.bin/.idx: {count['documents']} documents, {count['tokens']} "
        f"tokens (byte-level) from {len(args.input)} files"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
