source .gpu/common.sh
rm -rf /tmp/old && mkdir -p /tmp/old && cp -a . /tmp/old/ && cp -r .gpu/old/. /tmp/old/ && rm -f /tmp/old/kernels/triton_mla_write.py
part tests 170 python3 -m pytest -q -p no:cacheprovider tests/test_fused_layer.py tests/test_gpu_graphs.py tests/test_lossless_rows.py tests/test_kernel_rows.py tests/test_gpu.py tests/test_draft_chain.py -k "not flashinfer"
P="python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0 --batches 1,32 --max-tokens 32"
part profnew 80 $P --out /tmp/r/pnew
part profold 80 bash -c "cd /tmp/old && $P --out /tmp/r/pold"
part speed 120 python3 -m tandem bench speed --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --in-process --out /tmp/r/speed
part fp8 80 python3 -m tandem bench fp8 --parts v2lite --out /tmp/r/fp8
tail -4 $OUT/tests.log; for f in /tmp/r/pnew/*.txt /tmp/r/pold/*.txt; do echo $f; head -1 $f; done
grep "^|" /tmp/r/speed/speed.md | cut -c1-400; grep -A8 "^| weights" /tmp/r/fp8/fp8.md
cp $OUT/*.log /tmp/r/ 2>/dev/null; tar czf $OUT/r.tgz -C /tmp r; rm -f $OUT/*.log
cat $OUT/parts.txt
