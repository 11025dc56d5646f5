# session 23, call E: the draft's Propose profiled (.gpu/prof23.py)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part prof 240 python3 .gpu/prof23.py; snap
grep -A24 "^==" $R/prof.log; tail -4 $R/prof.log
cat $OUT/parts.txt
