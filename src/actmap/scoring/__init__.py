"""Scores and what they are judged by: the one scorer contract, AUROC/ECE metrics, bootstrap
intervals and the prior (prevalence) correction of p(correct)."""
