source .gpu/common.sh
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 2"
part zero 200 $B --repeats 3 --speculation adaptive,fixed --synthetic-acceptance 0.02 --out /tmp/zero
tar czf $OUT/zero.tgz -C /tmp zero
part tests 160 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_graphs.py tests/test_lossless_rows.py tests/test_draft_chain.py tests/test_gpu.py tests/test_fused_layer.py -k "not flashinfer"
part r1 190 $B --repeats 2 --speculation fixed,adaptive,fixed/serial --synthetic-acceptance 0.92,0.72,0.36 --out /tmp/r1
tar czf $OUT/r1.tgz -C /tmp r1
tail -3 $OUT/tests.log; grep "^|" /tmp/zero/speed.md /tmp/r1/speed.md | cut -c1-220; cat $OUT/parts.txt | tail -4
