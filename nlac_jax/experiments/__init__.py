"""Unit-scale learning experiment: scripted warm-start corpus, warm-start trainer, arms, tables and plots."""
