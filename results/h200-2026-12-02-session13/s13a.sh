source .gpu/common.sh
# the tree before this session's changes (HEAD), for side-by-side step times in this call
rm -rf /tmp/old && mkdir -p /tmp/old && cp -a . /tmp/old/ && cp -r .gpu/old/. /tmp/old/ && rm -f /tmp/old/kernels/triton_mla_write.py
part tests 220 python3 -m pytest -q -x -p no:cacheprovider tests/test_fused_layer.py tests/test_lossless_rows.py tests/test_kernel_rows.py tests/test_gpu_graphs.py tests/test_draft_chain.py tests/test_gpu.py tests/test_model_kernels.py tests/test_moe_kernels.py -k "not flashinfer"
part probe 90 python3 .gpu/probe13.py eager
part profnew 80 python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0 --batches 1,32 --max-tokens 32 --out $OUT/pnew
part profnopdl 80 env TANDEM_PDL=off python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0 --batches 1,32 --max-tokens 32 --out $OUT/pnopdl
part profold 80 bash -c "cd /tmp/old && python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0 --batches 1,32 --max-tokens 32 --out $OUT/pold"
part speed 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --in-process --out /tmp/speed
cp /tmp/speed/speed.md $OUT/ 2>/dev/null
tail -3 $OUT/tests.log; head -4 $OUT/probe.log; for f in $OUT/pnew/*.txt $OUT/pnopdl/*.txt $OUT/pold/*.txt; do echo $f; head -1 $f; done
grep "^|" /tmp/speed/speed.md | cut -c1-400
tar czf $OUT/prof.tgz -C $OUT pnew pnopdl pold && rm -rf $OUT/pnew $OUT/pnopdl $OUT/pold; gzip -f $OUT/*.log
cat $OUT/parts.txt
