"""ds4sci.integrations"""
