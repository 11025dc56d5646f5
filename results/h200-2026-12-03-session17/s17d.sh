source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part kt 90 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernels.py
P="python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0,3 --batches 1,32 --max-tokens 32"
part profin 110 $P --out /tmp/pin
part profoff 110 env TANDEM_SHARED_IN_MOE=0 $P --out /tmp/poff
tail -2 $OUT/kt.log
for d in pin poff; do for f in /tmp/$d/*.txt; do echo $f; head -1 $f; grep -E "_gate_up_kernel|_down_kernel" $f | head -2 | awk '{print $1, $(NF-1), $NF}'; done; done
tar czf $R/prof.tgz -C /tmp pin poff
cat $OUT/parts.txt
