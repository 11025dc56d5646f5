# session 23, call D: the greedy acceptance in two launches (chunk maxima, then argmax + verify + packing) against
# HEAD's argmax stages + verify + cat, alternating processes; GPU tests; issue 14's lines at this tree
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
FILES="services/target/engine.py kernels/dispatch.py kernels/speculative.py kernels/triton_speculative.py"
use() { for f in $FILES; do cp .gpu/t23d/$1/$f $f; done; }
for i in 1 2 3; do
  for t in head new; do use $t; part step-$t$i 60 python3 .gpu/step23.py $t$i; snap; done
done
use new; git status --short | head -20
grep -h "^==" $R/step-*.log | sort -k3,3n -k5,5n -k7,7n
part gt 230 python3 -m pytest -q tests/test_triton_kernels.py tests/test_gpu_graphs.py tests/test_gpu.py tests/test_lossless_rows.py tests/test_draft_chain.py tests/test_gpu_bridge.py tests/test_engines.py -k "not flashinfer"; snap
tail -3 $R/gt.log
part speed 170 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --in-process --out $R/speed; snap
grep "^|" $R/speed.log | cut -d'|' -f2-5,7,9,12-14,20-26
cat $OUT/parts.txt
