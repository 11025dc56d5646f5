# session 23, call G: the draft's uploads not waiting on step 0 (HEAD vs this tree, alternating processes) + tests
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
FILES="services/draft/engine.py services/draft/chain.py models/batch.py"
use() { for f in $FILES; do cp .gpu/t23g/$1/$f $f; done; }
for t in new head; do use $t; part pw-${t}1 60 python3 .gpu/pw23.py ${t}1; snap; done
use new
grep -h "^==" $R/pw-*.log | sort -k3,3n -k5,5n
part gt 70 python3 -m pytest -q -x tests/test_draft_chain.py tests/test_gpu_graphs.py -k "not flashinfer"; snap
tail -2 $R/gt.log
cat $OUT/parts.txt
