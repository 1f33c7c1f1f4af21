set -x
export ROW_TIMEOUT=110
KTESTS="test_mgpu_tm.py test_attend_pallas.py" KSELECT="(int8 or slots_on_m) and not Interpret" TEST_TIMEOUT=150 BATCHES=8 CONTEXTS="32768" ROWS="cudnn-bf16 pallas-int8 pallas-int8+logits mgpu-tm-int8 mgpu-tm-int8+logits" OUT=$OUT/k bash scripts/gpu_bench.sh kernel 2>&1 | grep -v "^WARNING" | grep -v "^[│┃┏┡└]" | tail -20
grep -E "passed|failed|^FAILED|^ERROR|Error" $OUT/k/kernel_tests.txt | tail -12
ROWS="full confkv" OUT=$OUT/a bash scripts/gpu_bench.sh decode-scan 2>&1 | grep -E "ms/step|confkv|full|row|Error" | grep -v WARNING | tail -8
KVJAX_TUNING="mgpu_tiers=int8-tm" ROWS="confkv" OUT=$OUT/b bash scripts/gpu_bench.sh decode-scan 2>&1 | grep -E "ms/step|confkv|row|Error" | grep -v WARNING | tail -6
cd $OUT && tar czf all.tgz k a b && ls
