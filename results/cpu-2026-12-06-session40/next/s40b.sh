# session 40, call B: issue 14's standard command at the final tree (fe51316+), early against accept-first, 0.85 and R1-like
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --speculation fixed,fixed/accept-first --in-process --repeats 2"
part c85 230 python3 $S --synthetic-acceptance 0.85 --out $R/c85; snap
part r1 200 python3 $S --synthetic-acceptance 0.92,0.72,0.36 --out $R/r1; snap
for t in c85 r1; do echo "== $t"; grep -h "^| 0\|^| R1\|^| 0.92" $R/$t/speed.md | cut -d'|' -f2-7,10-15,21-; done
cat $OUT/parts.txt
