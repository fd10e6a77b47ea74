"""One profile's audit term on another day's pairs: how well ``decode.logprob_s_per_seq``, fitted by
`nodus fit-audit` on one day, predicts the throughput ratio (lighter audit over full) of other runs.

The term is carried in seconds as the fitting profile's decode steps spent it (term x its decode
scale), set on ``--base`` in that base's units, and each pair of ``runs`` (as `nodus fit-audit`
pairs them) is replayed on it; beside, the ratio with no term.

    python experiments/audit_crossday.py \
        --term-from calibration/profiles/h200-xeon16-graphed-stacks-audit-session32-qwen3-0.6b.json \
        --base calibration/profiles/h200-xeon16-graphed-qwen3-0.6b.json RUN... [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    from calibration.audit import audit_pairs, predict
    from sim.profile import profile_dict

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--term-from", required=True, help="profile whose decode.logprob_s_per_seq to carry")
    ap.add_argument("--base", required=True, help="profile to replay the runs on (their day's)")
    ap.add_argument("--out", default=None, metavar="PREFIX", help="write PREFIX.md and PREFIX.json")
    a = ap.parse_args(argv)
    src, prof = profile_dict(a.term_from), profile_dict(a.base)
    seconds = src["decode"].get("logprob_s_per_seq", 0.0) * src["decode"].get("scale", 1.0)
    if not seconds:
        raise SystemExit(f"audit_crossday: {a.term_from} has no decode.logprob_s_per_seq (nodus fit-audit)")
    term = seconds / prof["decode"].get("scale", 1.0)
    pairs = audit_pairs(a.runs)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        full = predict([p["full"] for p in pairs], prof, 0.0, tmp)
        light = predict([p["light"] for p in pairs], prof, term, tmp)
        bare = predict([p["light"] for p in pairs], prof, 0.0, tmp)
    rows = [{"light": p["light"]["run"], "full": p["full"]["run"], "measured_ratio": p["measured_ratio"],
             "predicted_ratio": li / fu, "error": (li / fu) / p["measured_ratio"] - 1,
             "error_without_term": (b / fu) / p["measured_ratio"] - 1}
            for p, fu, li, b in zip(pairs, full, light, bare)]
    n = len(rows)
    result = {"term_from": a.term_from, "base": a.base, "seconds_per_seq": seconds, "term": term, "rows": rows,
              "mape": sum(abs(r["error"]) for r in rows) / n, "bias": sum(r["error"] for r in rows) / n,
              "mape_without_term": sum(abs(r["error_without_term"]) for r in rows) / n}
    lines = [f"`decode.logprob_s_per_seq` of `{a.term_from}` ({seconds * 1e6:.2f} us a sequence and step) on "
             f"`{a.base}` ({term * 1e6:.2f} us before its decode scale), {n} pair(s): ratio error "
             f"{result['mape']:.1%} mean (bias {result['bias']:+.1%}), {result['mape_without_term']:.1%} with no term.",
             "", "| lighter run | measured ratio | predicted | error | with no term |", "|---|---|---|---|---|"]
    lines += [f"| {Path(r['light']).name} | {r['measured_ratio']:.3f} | {r['predicted_ratio']:.3f} | {r['error']:+.1%} "
              f"| {r['error_without_term']:+.1%} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(f"{a.out}.md").write_text(text)
        Path(f"{a.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
