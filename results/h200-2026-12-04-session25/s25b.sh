# session 25, call B (warm, after call T): the trained second edition (build/ck/tandem-code-mini, left by call T) on
# the H200: one MTP step against a target step (bench steps, CUDA graphs), and K = 3 vs K = 0 served with real
# acceptance at batch 1 / 8 / 32 (prompts from the held-out files); then the bundled model the same way, side by side
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
ls build/ck/tandem-code-mini > $R/ck.txt 2>&1 || echo "NO CHECKPOINT" | tee $R/ck.txt
part steps-new 80 python3 -m tandem.bench_steps --model build/ck/tandem-code-mini --device cuda --batches 1,8,32 --out $R/steps-new.json; snap
part speed-new 200 python3 -m tandem bench speed --device cuda --model build/ck/tandem-code-mini --ks 0,3 --batches 1,8,32 --max-tokens 64 --repeats 2 --out $R/speed-new; snap
grep "^|" $R/speed-new.log | head -12
part steps-old 60 python3 -m tandem.bench_steps --model checkpoints/tandem-code-mini --device cuda --batches 1,8,32 --out $R/steps-old.json; snap
part speed-old 150 python3 -m tandem bench speed --device cuda --model checkpoints/tandem-code-mini --ks 0,3 --batches 1,8,32 --max-tokens 64 --repeats 2 --out $R/speed-old; snap
grep "^|" $R/speed-old.log | head -12
cat $OUT/parts.txt
