source .gpu/common.sh
part tests 230 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernels.py tests/test_fused_layer.py tests/test_lossless_rows.py tests/test_gpu_graphs.py tests/test_gpu.py tests/test_gpu_bridge.py tests/test_draft_chain.py tests/test_gpu_fp8.py -k "not flashinfer"
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --in-process"
part speedin 130 $S --out /tmp/r/speedin
part speedoff 130 env TANDEM_SHARED_IN_MOE=0 $S --out /tmp/r/speedoff
tail -4 $OUT/tests.log; grep -h "round calls on the local lane\|local lane" $OUT/tests.log | head -3
for d in speedin speedoff; do echo "== $d"; grep "^|" /tmp/r/$d/speed.md | cut -d'|' -f2-22; done
cp $OUT/*.log /tmp/r/ 2>/dev/null; tar czf $OUT/r.tgz -C /tmp r; rm -f $OUT/*.log
cat $OUT/parts.txt
