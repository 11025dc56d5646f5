source .gpu/common.sh
part probe 60 python3 .gpu/s6probe3.py
part tests 120 python3 -m pytest -q tests/test_kernel_rows.py tests/test_lossless_rows.py tests/test_dsa_kernels.py
part speed 330 python3 -m tandem bench speed --device cuda --random-config v2-lite --synthetic-acceptance 0.92,0.72,0.36 --speculation adaptive,fixed --ks 0,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2 --out /tmp/r1
cp /tmp/r1/*.md $OUT/ 2>/dev/null
tail -n 3 $OUT/tests.log; cat $OUT/probe.log; cat /tmp/r1/*.md | head -20; cat $OUT/parts.txt
