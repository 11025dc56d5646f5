source .gpu/common.sh
part zero1 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --speculation adaptive,fixed --ks 0,3 --batches 1,8 --max-tokens 64 --requests-per-batch 2 --repeats 3 --synthetic-acceptance 0.02 --out /tmp/zero1
part fp8new 90 python3 -m tandem bench fp8 --parts v2lite --out /tmp/fnew
tar czf $OUT/e.tgz -C /tmp zero1 fnew
grep "^|" /tmp/zero1/speed.md; grep -A6 "^| weights" /tmp/fnew/fp8.md; cat $OUT/parts.txt
