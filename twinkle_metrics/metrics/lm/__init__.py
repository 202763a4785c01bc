"""Language-model metrics: loss, token accuracy, embedding quality."""
