# session 43, call B: one capture stream a device -- GPU tests of the graphs, then the draft's and target's graph
# memory with a new stream per capture (old) and one stream (new), V2-Lite, from the services' launch lines
WHL=.whl-lite source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
cat $OUT/gpu.txt
part t 230 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_graphs.py tests/test_draft_chain.py tests/test_early_propose.py tests/test_gpu.py; snap
tail -6 $R/t.log
cp models/cuda_graphs.py /tmp/cg_new.py
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 3 --batches 1 --max-tokens 16 --requests-per-batch 1 --repeats 1 --synthetic-acceptance 0.85"
for v in old new; do
  cp /tmp/cg_new.py models/cuda_graphs.py
  [ $v = old ] && sed -i 's/    if device not in _CAPTURE_STREAMS:/    if True:  # old/' models/cuda_graphs.py
  grep -c "if True:  # old" models/cuda_graphs.py
  part m_$v 110 python3 $S --out $R/m_$v; snap
  echo "== $v"; grep -h "graphs ready" $R/m_$v.log | cut -c25-
done
cp /tmp/cg_new.py models/cuda_graphs.py
cat $OUT/parts.txt
cd $OUT && tar czf r.tgz r && rm -rf r
