# session 26, call C: the draft's rows taken without a wait (RowChannel.take_later: checks after the compute) and the
# next round's Propose pushed before the rows it names (the draft's ring take waits for them): GPU tests, then the
# served round's phases again (call B's command)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part gt 260 python3 -m pytest -q tests/test_gpu_bridge.py tests/test_gpu.py tests/test_draft_chain.py tests/test_gpu_graphs.py -k "not flashinfer"; snap
tail -3 $R/gt.log; grep -E "^(FAILED|ERROR)" $R/gt.log | head
export PYTHONPATH=$PWD/.gpu/site:$PYTHONPATH
TANDEM_PHASES_DIR=$R/ph part ph 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32,1 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --speculation fixed --out $R/phspeed; snap
grep "^|" $R/ph.log | cut -d'|' -f2-14
python3 .gpu/phases26.py $R/ph
cat $OUT/parts.txt
