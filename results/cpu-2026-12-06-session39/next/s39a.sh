# session 39, call A (one GPU): the early push's tests on the GPU (engine level with CUDA graphs and the chain, served
# over the CUDA IPC ring), then issue 14's standard command, push sent as the acceptance is queued (fixed) against
# after the host read it (fixed/accept-first), side by side in one run, 0.85 and R1-like profiles. ~520 s.
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
git log --oneline -1 > $R/commit.txt 2>&1
part gtest 170 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_early_propose.py tests/test_gpu_bridge.py "tests/test_draft_chain.py::test_chain_graph_equals_loop_on_gpu" tests/test_propose_ahead.py -k "early or before_the_acceptance or ipc or shared_gpu or gpu or bench_bridge"; snap
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --speculation fixed,fixed/accept-first --in-process --repeats 2"
part c85 210 python3 $S --synthetic-acceptance 0.85 --out $R/c85; snap
part r1 170 python3 $S --synthetic-acceptance 0.92,0.72,0.36 --out $R/r1; snap
for t in c85 r1; do echo "== $t"; grep -h "^|" $R/$t/speed.md | cut -d'|' -f2-7,9-14,21-; done
cat $OUT/parts.txt
