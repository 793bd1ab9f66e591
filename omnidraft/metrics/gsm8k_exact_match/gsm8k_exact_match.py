"""GSM8K exact match of the final number (omnidraft.data.quality.exact_match), as an evaluate metric."""

import datasets
import evaluate

from omnidraft.data.quality import exact_match


class Gsm8kExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Whether the answer's final number (after '####' or 'answer is', else the last number) "
                        "equals the reference number.",
            citation="Cobbe et al., Training Verifiers to Solve Math Word Problems, 2021.",
            inputs_description="predictions: model answers (str); references: reference numbers (str).",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        scores = [exact_match(p, r) for p, r in zip(predictions, references)]
        return {"exact_match": sum(scores) / len(scores) if scores else 0.0}
