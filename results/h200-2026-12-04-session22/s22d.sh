# session 22, call D: the step's host layout as plain lists (models/kv_cache.py) vs CPU tensor ops, alternating
# processes; the graph / lossless / engine GPU tests on the new layout
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
cp models/kv_cache.py /tmp/kv_new.py
for i in 1 2; do
  cp .gpu/old22/models/kv_cache.py models/kv_cache.py; part step-old$i 40 python3 .gpu/step22.py old$i; snap
  cp /tmp/kv_new.py models/kv_cache.py; part step-new$i 40 python3 .gpu/step22.py new$i; snap
done
grep -h "^==" $R/step-*.log
part gt 110 python3 -m pytest -q -x tests/test_gpu_graphs.py tests/test_lossless_rows.py tests/test_gpu.py -k "not flashinfer and (graph or lossless or greedy or verify or row)"; snap
tail -3 $R/gt.log
cat $OUT/parts.txt
