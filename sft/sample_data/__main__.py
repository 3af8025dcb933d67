from sft.sample_data import main

main()
