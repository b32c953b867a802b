"""Training dynamics: health statistics sampled during training and the early warnings
derived from them (layer norms, update ratios, activations, optimizer state, learning-rate
schedule, clipping, logit saturation). Each monitor computes; the guard stores and reports."""
