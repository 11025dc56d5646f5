# session 34, call E (call D with 6 x batch requests): issue 14's standard command, served vs in-process, on the push-era tree (one H100, IPC ring)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part s64 400 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 6 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/s64; snap
grep -h "^|" $R/s64/speed.md | cut -d'|' -f2-14
cat $OUT/parts.txt
