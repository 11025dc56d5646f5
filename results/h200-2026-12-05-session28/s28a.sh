# session 28, call A: GPU tests of sessions 27-28's code (bridge, lanes, layout, draft chain, graphs, grouped training
# experts), the take and layout probes (mb27.py), and the H200 draft / target step ratio at 20 and 40 layers
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
git log --oneline -1 > $R/commit.txt 2>/dev/null
part gt 300 python3 -m pytest -q tests/test_gpu_bridge.py tests/test_gpu.py tests/test_draft_chain.py tests/test_gpu_graphs.py tests/test_local_lane.py tests/test_gpu_train.py -k "not flashinfer"; snap
tail -2 $R/gt.log; grep -E "^(FAILED|ERROR)" $R/gt.log | head
part mb 80 python3 .gpu/mb27.py $R/mb27.json; snap
grep -E "^(take|prepare)" $R/mb.log
for L in 20 40; do part steps$L 90 python3 -m tandem bench steps --device cuda --arch num_hidden_layers=$L --batches 1,8,32 --iters 50 --out $R/steps-L$L.json; snap; done
grep -h "batch" $R/steps20.log $R/steps40.log
cat $OUT/parts.txt
