# session 23, call C: the verify's host order and committed-row copy (HEAD vs this tree, alternating processes), the
# GPU tests of this tree, and the MLA decode kernel's tile / warp choices (.gpu/att23.py)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part att 200 python3 .gpu/att23.py; snap
grep "^==\|compiled" $R/att.log
FILES="services/target/engine.py kernels/dispatch.py kernels/rows.py"
use() { for f in $FILES; do cp .gpu/t23c/$1/$f $f; done; }
for i in 1 2 3; do
  for t in head new; do use $t; part step-$t$i 60 python3 .gpu/step23.py $t$i; snap; done
done
use new; git status --short | head
grep -h "^==" $R/step-*.log | sort -k3,3n -k5,5n -k7,7n
part gt 230 python3 -m pytest -q tests/test_gpu_graphs.py tests/test_gpu.py tests/test_lossless_rows.py tests/test_draft_chain.py tests/test_gpu_bridge.py tests/test_triton_kernels.py -k "not flashinfer"; snap
tail -3 $R/gt.log
cat $OUT/parts.txt
