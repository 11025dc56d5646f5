# session 28's plan, call S (before T1; ~4 minutes): is edition 3's depth worth its training? One MTP step against one
# target step on the H200 (bf16, CUDA graphs as served) at 20 layers (edition 2's shape), 30 and 40 (edition 3's),
# random weights, `tandem bench steps`; then one MoE layer's forward + backward, dense against grouped (moe28.py).
# The image's packages only: carry [".gpu"]; results/ and checkpoints/ out of the tree.
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); R=$OUT/r; mkdir -p $R
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $R/run.log; }
for L in 20 30 40; do
  log "steps, $L layers"
  timeout 120 python3 -m tandem bench steps --device cuda --arch num_hidden_layers=$L --batches 1,8,32 --iters 50 \
    --out $R/steps-L$L.json >> $R/run.log 2>&1
done
log "MoE layer, dense vs grouped"; timeout 200 python3 .gpu/moe28.py $R/moe28.json >> $R/run.log 2>&1
tar czf $OUT/r.tgz -C $OUT r; log done
