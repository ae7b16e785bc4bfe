"""Build the 40 extraction prompts of issue 13 from Spec-Bench (20 rag + 20 summarization
records of ``shared/data/spec_bench/question.jsonl``): each asks for the JSON of
``schema.json`` about the record's text, written to ``prompts.jsonl`` beside this file.
Run: python tests/data/extraction/make_prompts.py [path/to/spec_bench/question.jsonl]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parents[2].parent / "shared" / "data" / "spec_bench" / "question.jsonl"
INSTRUCTION = ("Extract from the text above, as JSON: a short title, up to three people or "
               "organisations it names, the main place, and a one-sentence summary.")


def main() -> None:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    out = []
    for category in ("rag", "summarization"):
        for r in [r for r in rows if r["category"] == category][:20]:
            text = r["turns"][0].removeprefix("Summarize: ").strip()
            out.append({"id": r["question_id"], "category": category,
                        "messages": [{"role": "user", "content": f"{text}\n\n{INSTRUCTION}"}]})
    with open(HERE / "prompts.jsonl", "w") as f:
        for o in out:
            f.write(json.dumps(o, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
