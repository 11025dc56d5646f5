# s30a's first part again with room: the standard command (issue 14) did not finish in 150 s
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part s64 480 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/s64; snap
grep "^|" $R/s64*.log | cut -d'|' -f2-9,20-23
cat $OUT/parts.txt
