# session 41, call C: the early Propose sent with the rows (new) against after the acceptance is queued (old),
# bundled model, alternating; then the GPU files that serve the early push
WHL=.whl-lite source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
cat $OUT/gpu.txt
M=checkpoints/tandem-code-mini
for v in new old new old; do
  cp .gpu/server_$v.py services/target/server.py
  part s_$v 70 python3 -m tandem bench speed --device cuda --model $M --ks 0,3 --batches 1,8 --max-tokens 64 --requests-per-batch 4 --repeats 2 --out $R/p_$v; snap
  grep -h "^| model" $R/s_$v.log | cut -d'|' -f2-7,9-17
done
cp .gpu/server_new.py services/target/server.py
part t 170 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_bridge.py tests/test_early_propose.py; snap
tail -4 $R/t.log
cat $OUT/parts.txt
