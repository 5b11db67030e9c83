"""`disagg bench`: a load generator for the Generation API (in the style of vLLM `bench serve`)."""
