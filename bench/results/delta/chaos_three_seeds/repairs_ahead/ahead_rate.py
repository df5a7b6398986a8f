import sys, os, json, glob
from wb.runtime.transport.stores import read_record
for d in sys.argv[1:]:
    st = os.path.join(d, "store")
    recs = []
    for f in glob.glob(os.path.join(st, "*attempt*")):
        raw = open(f, "rb").read()
        try:
            rec = read_record(raw, os.path.basename(f))
        except Exception as e:
            continue
        if "planned_ahead" in rec:
            recs.append(rec)
    n = len(recs); a = sum(bool(r["planned_ahead"]) for r in recs)
    ps = sorted(round(r["planned_s"] * 1e3, 1) for r in recs)
    print(d, f"planned ahead {a}/{n}", "planned_s ms", ps)
