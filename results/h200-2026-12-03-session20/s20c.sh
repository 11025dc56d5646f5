# session 20, call C: the in-launch merge with a loop over live splits (not unrolled), the IPC take's event query;
# GPU tests, the MLA sweep (default rule), bf16 / fp8 step with the merge off / on, served speed, bridge
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part mla 45 python3 .gpu/mla20.py 35
python3 .gpu/mlasum.py $OUT/mla.log > $OUT/mla-summary.txt; cat $OUT/mla-summary.txt
part speed 170 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --in-process --out $R/speed
grep "^|" $R/speed/speed.md | cut -d'|' -f2-14,20-26
part bridge 30 python3 -m tandem bench bridge --device cuda --out $R/bridge
grep "^|" $R/bridge/*.md
part fp8off 45 env TANDEM_ATTENTION_MERGE=0 python3 -m tandem bench fp8 --parts v2lite --out $R/fp8off
part fp8on 45 python3 -m tandem bench fp8 --parts v2lite --out $R/fp8on
grep -A6 "^| weights" $R/fp8off/fp8.md $R/fp8on/fp8.md
part gt 200 python3 -m pytest -q -x tests/test_gpu_bridge.py tests/test_kernel_rows.py tests/test_draft_chain.py tests/test_gpu.py -k "not flashinfer"
tail -5 $OUT/gt.log
cp $OUT/*.log $OUT/*.txt $R/ 2>/dev/null; rm -f $OUT/*.log
tar czf $OUT/r.tgz -C $OUT r; rm -rf $R
cat $OUT/parts.txt
