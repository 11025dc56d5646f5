# session 37, call E (one GPU, short): a batch-32 verify step (4 tokens a request) against a decode step, kernel by kernel
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part vk 130 python3 .gpu/verify_kernels36.py 32; mv $OUT/*.log $R/; cp $OUT/parts.txt $R/
head -40 $R/vk.log | grep -v USDT
