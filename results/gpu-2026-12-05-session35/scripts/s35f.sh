# session 35, call F (one GPU): issue 14's standard command with the in-process rows repeated as the served ones
# (--repeats 2), both acceptance profiles, ~420 s
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part s64 500 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --repeats 2 --out $R/s64; snap
grep -h "^|" $R/s64/speed.md | cut -d'|' -f2-6,9,11,14,17,18,20-
cat $OUT/parts.txt
