"""``vllm-compat``: audit a vLLM before loading a model; list adapters; show what apply() does.

    vllm-compat audit [--vllm PATH] [--consumer speculators==X] [--json] [--live] [--debug]
    vllm-compat adapters [--json]

Exit codes: 0 everything native or adapted; 1 unknown drift or missing symbols; 2 usage errors
(a bad path, a file that is not a vLLM wheel, an unparsable version).
"""
from __future__ import annotations

import argparse
import json
import sys


def _audit(args) -> int:
    from .audit import audit

    result = audit(args.vllm, consumer=args.consumer, live=args.live)
    print(result.to_json() if args.json else result.render())
    return result.exit_code


def _adapters(args) -> int:
    from .registry import adapters

    rows = [
        {"id": a.id, "scope": a.scope.value, "vllm": str(a.vllm),
         "speculators": str(a.speculators) if a.speculators else "any", "summary": a.summary, "drift": a.drift}
        for a in adapters()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            print(f"{row['id']:38} {row['scope']:9} vllm {row['vllm']:10} speculators {row['speculators']:15} "
                  f"{row['summary']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-compat", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    audit = sub.add_parser("audit", help="check a vLLM (installed, a wheel or a source tree) against every adapter")
    audit.add_argument("--vllm", metavar="PATH", help="a .whl file or a directory holding vllm/ (read, never imported)")
    audit.add_argument("--consumer", metavar="speculators==X", help="whose expectations to check (default: installed)")
    audit.add_argument("--json", action="store_true", help="machine-readable output (schema in docs/audit.md)")
    audit.add_argument("--live", action="store_true", help="import the installed vLLM and inspect live objects")
    audit.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    audit.set_defaults(run=_audit)
    listing = sub.add_parser("adapters", help="list every adapter with its scope and vLLM range")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--debug", action="store_true")
    listing.set_defaults(run=_adapters)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .errors import VllmCompatError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except VllmCompatError as exc:
        if args.debug:
            raise
        print(f"vllm-compat: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
