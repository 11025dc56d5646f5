# session 21, call B: PDL in a graph (micro), the bf16 MoE tiles with shared experts inside, the step's copies
source .gpu/common.sh
part pdl 100 python3 .gpu/pdl21.py
cat $OUT/pdl.log | grep -v Warn | head -40
part copies 120 python3 .gpu/copies21.py
head -30 $OUT/copies.log
part moe 260 python3 .gpu/moe21.py $OUT/moe.json 230 1,4,32
grep "N=" $OUT/moe.log | cut -c1-400
cat $OUT/parts.txt
