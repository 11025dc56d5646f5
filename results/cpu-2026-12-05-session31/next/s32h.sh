# plan for a lent GPU machine (written in session 31, no device lent then): issue 14 item 4, two micro-batches
# alternating, measured with `tandem bench speed --speculation fixed,fixed/halves` (the same mode on one gateway,
# and on two gateways with half the clients each, one target and draft). On nvidia-h200-x2 the draft gets cuda:1
# (the case the issue names: separate GPUs); on one H200 both share it (host work of one half may hide behind the
# other's kernels). Batch 32 at 64 and 256 new tokens (64-token requests leave K = 3's slots ~85 % filled).
# Copy into .gpu/ with common.sh (results/h200-2026-12-04-session21/common.sh); carry [".whl", ".gpu"].
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --synthetic-acceptance 0.85 --speculation fixed,fixed/halves"
part h64 240 $S --batches 8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2 --out $R/h64; snap
part h256 240 $S --batches 32 --max-tokens 256 --requests-per-batch 2 --out $R/h256; snap
grep -h "^|" $R/h64/speed.md $R/h256/speed.md | cut -d'|' -f2-12
cat $OUT/parts.txt
