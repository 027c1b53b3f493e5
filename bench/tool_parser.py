"""Cost of the streamed tool-call parser: one call with ~80 KB of arguments (quotes and braces
inside strings) fed in 4-character pieces, per format. Prints the time per piece.

    python bench/tool_parser.py
"""

from __future__ import annotations

import json
import time

from radixpool.worker.server.tool_parsers import ToolCallParser

ARGS = json.dumps({"items": [{"k": f"v{i}", "n": i, "s": 'a"b}{'} for i in range(2000)]},
                  separators=(", ", ": "))
REPLIES = {"hermes": f'<tool_call>\n{{"name": "f", "arguments": {ARGS}}}\n</tool_call>',
           "llama3": f'{{"name": "f", "parameters": {ARGS}}}',
           "mistral": f'[TOOL_CALLS][{{"name": "f", "arguments": {ARGS}}}]'}


def main() -> None:
    for fmt, text in REPLIES.items():
        pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
        best = float("inf")
        for _ in range(5):
            parser = ToolCallParser(fmt, {"f"})
            start = time.perf_counter()
            for piece in pieces:
                parser.feed(piece)
            parser.finish()
            best = min(best, time.perf_counter() - start)
            assert parser.calls == 1
        print(f"{fmt:8s} {len(text)} chars in {len(pieces)} pieces: {best * 1e3:.1f} ms, "
              f"{best / len(pieces) * 1e6:.2f} us per piece (best of 5)")


if __name__ == "__main__":
    main()
