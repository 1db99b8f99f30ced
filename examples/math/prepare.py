"""GSM8K-format records -> the spec's prompt JSONL.

    python -m examples.math.prepare gsm8k/train.jsonl --out var/math/train.jsonl
    python -m examples.math.prepare test-00000-of-00001.parquet --out var/math/eval.jsonl

Reads records with `question` and `answer` (a worked solution ending `#### N`, as GSM8K's) from
a JSONL file, or from a parquet file when pyarrow is installed (the Hugging Face copy of GSM8K
is parquet). Writes one JSON object per line, the keys the spec's `dataset.prompt_key` and
`dataset.answer_key` name by default:

    {"prompt": "<question> Let's think step by step and output the final answer after \\"####\\".",
     "answer": "72"}

The answer is the final number alone (thousands separators dropped), which the recipe's reward
(`examples.math.reward:final_answer`) and the built-ins `numeric_match` and `math_verify` all
read. A record without `question`, or whose answer has no `#### N`, stops the script with its
line number; `--limit` keeps the first N records.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""Appended to every question (verl's GSM8K recipe uses the same words)."""
_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def gold(answer: str) -> str:
    """The final number of a GSM8K answer (`... #### 1,234` -> `1234`); ValueError without."""
    m = _FINAL.search(answer.strip())
    if m is None:
        raise ValueError(f"answer does not end with '#### <number>': {answer[-80:]!r}")
    return m.group(1).replace(",", "")


def to_row(record: dict, instruction: str = INSTRUCTION) -> dict:
    """One GSM8K record as a prompt row."""
    for key in ("question", "answer"):
        if not isinstance(record.get(key), str):
            raise ValueError(f"no {key!r} string in the record")
    question = record["question"].strip()
    prompt = f"{question} {instruction}" if instruction else question
    return {"prompt": prompt, "answer": gold(record["answer"])}


def read_records(path: Path) -> Iterator[dict]:
    """The records of a JSONL or (with pyarrow) parquet file, in order."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(
                f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert the"
                " file to JSONL"
            ) from None
        yield from pq.read_table(path).to_pylist()
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def prepare(src: Path, out: Path, limit: int | None = None, instruction: str = INSTRUCTION) -> int:
    """Write the prompt rows of `src` to `out`; returns how many."""
    rows = []
    for n, record in enumerate(read_records(src), start=1):
        try:
            rows.append(to_row(record, instruction))
        except ValueError as e:
            raise SystemExit(f"{src}: record {n}: {e}") from None
        if limit is not None and len(rows) >= limit:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return len(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src", type=Path, help="GSM8K-format records: .jsonl, or .parquet")
    p.add_argument("--out", type=Path, required=True, help="the prompt JSONL to write")
    p.add_argument("--limit", type=int, default=None, help="keep the first N records")
    p.add_argument("--instruction", default=INSTRUCTION, help="appended to each question")
    a = p.parse_args()
    n = prepare(a.src, a.out, a.limit, a.instruction)
    print(f"wrote {n} prompts to {a.out}")


if __name__ == "__main__":
    main()
