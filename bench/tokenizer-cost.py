"""What the engine's tokenizer would cost on the decision's path: encodes a
text cut to 10 KB, 100 KB and 1 MB with a Hugging Face `tokenizer.json`
(the `tokenizers` library vLLM uses: a Rust core behind this binding) and
prints the time per encode.

    .hearth/vllm/venv/bin/python bench/tokenizer-cost.py \\
        .hearth/vllm/model/tokenizer.json ARCHITECTURE.md
"""

import sys
import time

from tokenizers import Tokenizer

tok = Tokenizer.from_file(sys.argv[1])
base = open(sys.argv[2]).read()
for size in (10_000, 100_000, 1_000_000):
    text = (base * (size // len(base) + 1))[:size]
    tok.encode(text)
    n = 5 if size < 1_000_000 else 3
    start = time.perf_counter()
    for _ in range(n):
        ids = tok.encode(text).ids
    took = (time.perf_counter() - start) / n
    print(
        f"{size} bytes: {len(ids)} tokens, {took * 1e3:.2f} ms per encode, "
        f"{size / took / 1e6:.1f} MB/s"
    )
