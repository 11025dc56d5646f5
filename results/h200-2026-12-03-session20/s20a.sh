# session 20, call A: the MLA split sweep (merged inside vs two launches), GPU tests, the step vs floor with the
# merge off / on, the IPC take bench, the launch sites of a step
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part mla 170 python3 .gpu/mla20.py 150
python3 .gpu/mlasum.py $OUT/mla.log > $OUT/mla-summary.txt
cat $OUT/mla-summary.txt
part floor0 80 env TANDEM_ATTENTION_MERGE=0 python3 -m tandem bench floor --device cuda --random-config v2-lite --batches 1,32 --ks 0,3 --prompt-tokens 64 --out $R/floor0
part floor1 80 python3 -m tandem bench floor --device cuda --random-config v2-lite --batches 1,32 --ks 0,3 --prompt-tokens 64 --out $R/floor1
grep "^|" $R/floor0/*.md; grep "^|" $R/floor1/*.md
part gt 200 python3 -m pytest -q -x tests/test_gpu.py tests/test_gpu_bridge.py tests/test_draft_chain.py tests/test_kernel_rows.py -k "not flashinfer"
part bridge 45 python3 -m tandem bench bridge --device cuda --out $R/bridge
grep "^|" $R/bridge/*.md
part stack 60 python3 .gpu/stack20.py
head -60 $OUT/stack.log
cp $OUT/*.log $OUT/*.txt $R/ 2>/dev/null; rm -f $OUT/*.log
tar czf $OUT/r.tgz -C $OUT r; rm -rf $R
cat $OUT/parts.txt
