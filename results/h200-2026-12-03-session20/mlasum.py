import json
import sys

for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    d = json.loads(line)
    if "H" not in d:
        print(d)
        continue
    a, m, b = d["default_two_launches"], d["default_merged"], d["best"]
    top = sorted((r for r in d["all"] if "us" in r), key=lambda r: r["us"])[:3]
    print(f"H{d['H']:3} N{d['N']:3} L{d['L']:4}: two {a.get('us')} merged {m.get('us')} (bits equal: "
          f"{m.get('rel') == a.get('rel')}) | " + " ; ".join(
              f"{r['us']} bn{r['block_n']} s{r['splits']} w{r['num_warps']}{' m' if r['merge'] else ''}" for r in top)
          + f" | max rel {max(r['rel'] for r in d['all'] if 'rel' in r):.1e}")
