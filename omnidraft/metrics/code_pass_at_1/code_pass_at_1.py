"""HumanEval / MBPP pass@1 (one sample per problem), the generated code run in omnidraft's sandbox."""

import json

import datasets
import evaluate

from omnidraft.data.quality import humaneval_program, mbpp_program
from omnidraft.data.sandbox import run_program


class CodePassAt1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="pass@1: the answer's code (its first fenced block), with the problem's tests, runs to "
                        "exit code 0 in a confined process (omnidraft.data.sandbox).",
            citation="Chen et al., Evaluating Large Language Models Trained on Code, 2021.",
            inputs_description="predictions: model answers (str); references: JSON of the problem's metadata "
                               "with 'task' = humaneval (prompt, test, entry_point) or mbpp (test_list, "
                               "test_setup_code).",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references, timeout: float = 10.0, memory_mb: int = 1024):
        passed = []
        for answer, ref in zip(predictions, references):
            meta = json.loads(ref) if isinstance(ref, str) else dict(ref)
            prog = humaneval_program(answer, meta) if meta.get("task") == "humaneval" else mbpp_program(answer, meta)
            passed.append(float(run_program(prog, timeout=timeout, memory_mb=memory_mb).passed))
        return {"pass@1": sum(passed) / len(passed) if passed else 0.0}
