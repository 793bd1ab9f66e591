"""XSum ROUGE-1/2/L F1 (rouge-score, stemmed), the runner's quality/rouge* keys, as an evaluate metric."""

import datasets
import evaluate

from omnidraft.data.quality import rouge


class SummaryRouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Mean ROUGE-1, ROUGE-2 and ROUGE-L F1 of summaries against references (stemmed).",
            citation="Lin, ROUGE: A Package for Automatic Evaluation of Summaries, 2004.",
            inputs_description="predictions: summaries (str); references: reference summaries (str).",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        scores = [rouge(p, r) for p, r in zip(predictions, references)]
        keys = ("rouge1", "rouge2", "rougeL")
        return {k: sum(s[f"quality/{k}"] for s in scores) / len(scores) if scores else 0.0 for k in keys}
