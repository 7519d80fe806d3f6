"""Label-free signals of the one capture pass and the methods built on them (RAUQ, TAD): the
low room both `actmap.detectors` (the stacked actmap-plus) and `actmap.baselines` import.

    steps   an answer's per-step log-probs / entropies, its attention entries, log-perplexity,
            mean token entropy
    rauq    RAUQ's recurrence and its scorer (no labels)
    tad     TAD's features, recurrence and its two-stage Ridge
"""
