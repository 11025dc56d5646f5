# session 22, call C: host transfers through pinned memory (old / new tree, alternating processes), the step's host
# timeline, GPU tests, issue 14's lines. Logs go into r/ and r.tgz is rebuilt after every part.
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
FILES="models/kv_cache.py services/target/engine.py services/draft/engine.py services/draft/chain.py"
mkdir -p /tmp/new22; for f in $FILES; do mkdir -p /tmp/new22/$(dirname $f); cp $f /tmp/new22/$f; done
old() { for f in $FILES; do cp .gpu/old22/$f $f; done; }
new() { for f in $FILES; do cp /tmp/new22/$f $f; done; }
for i in 1 2; do
  old; part step-old$i 45 python3 .gpu/step22.py old$i; snap
  new; part step-new$i 45 python3 .gpu/step22.py new$i; snap
done
grep -h "^==" $R/step-*.log
part host 60 python3 .gpu/host22.py; snap
grep -A3 "^== one step" $R/host.log
part gt 200 python3 -m pytest -q tests/test_gpu_graphs.py tests/test_gpu.py tests/test_lossless_rows.py tests/test_draft_chain.py tests/test_gpu_bridge.py -k "not flashinfer"; snap
tail -3 $R/gt.log
part speed 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --in-process --out $R/speed; snap
grep "^|" $R/speed.log | cut -d'|' -f2-5,7,9,12-14,20-26
cat $OUT/parts.txt
