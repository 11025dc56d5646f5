# session 23, call B: graph launch cost and split graphs (.gpu/exp23.py)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part exp 200 python3 .gpu/exp23.py; snap
grep "^==" $R/exp.log; tail -5 $R/exp.log
cat $OUT/parts.txt
