# session 23, call F: the draft's Propose under cProfile (.gpu/dprof23.py)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part dprof 150 python3 .gpu/dprof23.py; snap
grep -A40 "^== batch" $R/dprof.log | head -120
cat $OUT/parts.txt
