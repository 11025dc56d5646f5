source .gpu/common.sh
part kt 150 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernels.py tests/test_fused_layer.py
P="python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0 --batches 1,32 --max-tokens 32"
part profin 90 $P --out /tmp/r/pin
part profoff 90 env TANDEM_SHARED_IN_MOE=0 $P --out /tmp/r/poff
part fp8in 60 python3 -m tandem bench fp8 --parts v2lite --out /tmp/r/fp8in
part fp8off 60 env TANDEM_SHARED_IN_MOE=0 python3 -m tandem bench fp8 --parts v2lite --out /tmp/r/fp8off
part mla 200 python3 .gpu/mla17.py /tmp/r/mla.json
tail -3 $OUT/kt.log; for f in /tmp/r/pin/*.txt /tmp/r/poff/*.txt; do echo $f; head -1 $f; done
for d in fp8in fp8off; do echo $d; grep -A6 "^| weights" /tmp/r/$d/fp8.md; done
grep -v "^ " $OUT/mla.log | tail -25
cp $OUT/*.log /tmp/r/ 2>/dev/null; tar czf $OUT/r.tgz -C /tmp r; rm -f $OUT/*.log
cat $OUT/parts.txt
