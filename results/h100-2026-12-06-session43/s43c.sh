# session 43, call C: issue 14's standard command (0.85) with one capture stream, old (a stream per capture) and new
WHL=.whl-lite source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
cat $OUT/gpu.txt
cp models/cuda_graphs.py /tmp/cg_new.py
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --speculation fixed --repeats 2 --synthetic-acceptance 0.85"
for v in old new old new; do
  cp /tmp/cg_new.py models/cuda_graphs.py
  [ $v = old ] && sed -i 's/    if device not in _CAPTURE_STREAMS:/    if True:  # old/' models/cuda_graphs.py
  n=$((n+1)); part c_$v$n 140 python3 $S --out $R/c_$v$n; snap
  echo "== $v"; grep -h "graphs ready" $R/c_$v$n.log | cut -c25-
  grep -h "^| 0" $R/c_$v$n/speed.md | cut -d'|' -f2-7,10-15
  nvidia-smi --query-gpu=memory.used --format=csv
done
cp /tmp/cg_new.py models/cuda_graphs.py
cat $OUT/parts.txt
cd $OUT && tar czf r.tgz r && rm -rf r
