# Session 64: the host gaps of recorded (or simulated) runs, per action of a group or stack, mean seconds:
# a generation's end to its train's start, a train's end to its publish's start, a publish's end to the
# next generation's start. Run from the repository root: python experiments/results/h200/session64/host_gaps.py RUN_DIR...
import sys, json, gzip, collections, statistics as st
from pathlib import Path
for rd in sys.argv[1:]:
    p = Path(rd) / "spans.jsonl.gz"
    txt = gzip.open(p, "rt").read() if p.exists() else (Path(rd) / "spans.jsonl").read_text()
    act = collections.defaultdict(lambda: [1e18, -1e18])
    for l in txt.splitlines():
        d = json.loads(l); ph = d.get("phase")
        if ph not in ("train", "generate", "publish"): continue
        a = d.get("attrs") or {}
        step = a.get("version", 0) - 1 if ph == "publish" else a.get("step")
        k = (d.get("gpu"), d.get("group"), d.get("stack"), ph, step); x = act[k]
        x[0] = min(x[0], d["start_s"]); x[1] = max(x[1], d["end_s"])
    g2t, t2p, p2g = [], [], []
    for (g, grp, s, ph, step), (a0, a1) in act.items():
        if ph == "generate" and (g, grp, s, "train", step) in act: g2t.append(act[(g, grp, s, "train", step)][0] - a1)
        if ph == "train" and (g, grp, s, "publish", step) in act: t2p.append(act[(g, grp, s, "publish", step)][0] - a1)
        if ph == "publish" and (g, grp, s, "generate", step + 1) in act: p2g.append(act[(g, grp, s, "generate", step + 1)][0] - a1)
    f = lambda v: round(st.mean(v), 4) if v else None
    print(rd[-55:], "gen->train", f(g2t), "train->pub", f(t2p), "pub->gen", f(p2g), "summary sph", round(json.load(open(Path(rd)/"summary.json"))["steps_per_gpu_hour"]))
